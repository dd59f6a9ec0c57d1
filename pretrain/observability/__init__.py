"""Where a run's numbers go beyond `metrics.jsonl`: experiment trackers (`trackers`)."""
