"""The `moestream` command line."""
