"""`dspark serve`: an OpenAI-compatible server over the continuous-batching engine."""
