"""Pieces every specd gRPC service shares."""
