"""Runnable examples of aenv's client side (HTTP only: they import ``aenv.rl`` / ``aenv.client`` and the E2B
SDK, never the server). Each has a ``main()`` that the integration tests run in a short form."""
