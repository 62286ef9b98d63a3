"""What the strategies, and the harness around them, cost on real ranks."""
