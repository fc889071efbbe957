"""Stand-in for Kimi's remote code. chordq copies this file and must never import or run it."""
raise RuntimeError("remote code was executed")
