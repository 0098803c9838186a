"""Fleet data loop: the episode store robots write to, its metadata DB, and readers for training."""
