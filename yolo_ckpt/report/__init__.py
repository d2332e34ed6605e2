"""What checkpointing buys, reported: the profile, the trade-off front, the comparison with vanilla, plots."""
