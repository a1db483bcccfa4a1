"""Example physicsnemo-shardext plugin package (see ``clamp``)."""
