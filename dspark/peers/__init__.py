"""Other runtimes run side by side with ours in `dspark bench speed` (`--peer`)."""
