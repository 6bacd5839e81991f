"""Live Textual dashboard of the engine."""
