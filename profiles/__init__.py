"""Data shipped with autopart: device specs and model presets (installed as autopart._profiles)."""
