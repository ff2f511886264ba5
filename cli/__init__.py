"""autopart's command line: thin commands over the public API."""
