"""The HTTP decision service behind ``flowdecision serve`` (see docs/SERVICE.md)."""

from .app import Service, create_app
from .config import ConfigError, Settings, load_settings

__all__ = ["ConfigError", "Service", "Settings", "create_app", "load_settings"]
