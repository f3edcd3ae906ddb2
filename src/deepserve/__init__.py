"""deepserve: plan, serve, gate and benchmark DeepSeek-V3-class models on your own hardware."""

__version__ = "0.1.0"
