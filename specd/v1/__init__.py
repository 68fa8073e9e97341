"""Generated gRPC stubs (specd.protogen)."""
