"""ROLL's configuration surface on this project's schema: its names, its keys and where each lands."""
