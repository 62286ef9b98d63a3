"""What a job would hold in memory and send per step, computed or simulated on one CPU."""
