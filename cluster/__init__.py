"""Cluster side of Tandem: configuration, Ray bootstrap, pools, Redis state and the CLI."""
