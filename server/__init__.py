"""gRPC policy server, its client library and the web dashboard. Coming with the server issue."""
