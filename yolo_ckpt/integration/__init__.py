"""yolo-ckpt inside Ultralytics: the trainers, the run's memory decisions, settings, DDP, the CLI."""
