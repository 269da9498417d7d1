"""Training: the train stage's loop, loss, schedule, resume and processes."""
