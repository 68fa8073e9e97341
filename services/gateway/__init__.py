"""specd services."""
