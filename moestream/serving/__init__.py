"""Front-ends that hold a conversation: the OpenAI-compatible HTTP server and the terminal chat."""
