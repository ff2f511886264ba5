"""Data shipped with autopart: device specs, model presets, reference profiles (installed as autopart._profiles)."""
