"""Where a load test runs: the ``Backend`` base with its load plan and run, the
simulator in virtual time, a server over HTTP in real time, and the factory that builds
them."""
