"""What a load test sends: arrival schedules, request sources, token counting."""
