"""Streaming machinery: the expert store, parallel reader, budgeted expert cache, read-ahead, memory."""
