"""What differs per task: the data, how a batch is made, and the loss and metric."""
