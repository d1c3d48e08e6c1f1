"""The pure core: the manifest format, planning, trees, dtypes, checksums, boxes. No I/O."""
