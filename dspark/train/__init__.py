"""Drafter training: losses, anchors, online target features, config and the training loop."""
