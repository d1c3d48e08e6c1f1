"""Moving bytes: the transfer engine (concurrency, retries, throttling), the I/O loop, host buffers, reading the manifest."""
