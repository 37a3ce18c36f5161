"""What reaches other processes: URLs (one module), the async HTTP transport and
its retry timing, and opening and closing what holds connections."""
