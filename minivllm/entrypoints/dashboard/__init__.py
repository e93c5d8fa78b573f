"""The dashboard: a live view of the engine core at /dashboard, fed by /v1/engine/events."""
