"""The HTTP load generator: transport, SSE reader, open-loop load."""
