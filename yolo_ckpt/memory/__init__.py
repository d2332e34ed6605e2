"""Measuring memory exactly: the live-tensor tracker, the device (real or simulated), one training step."""
