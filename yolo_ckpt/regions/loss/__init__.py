"""The criterion checkpointed: a loss plan installed on Ultralytics' criterion, and its pieces per task."""
