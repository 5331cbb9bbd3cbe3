"""mrl-lightning."""
