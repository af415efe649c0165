"""The agent's decisions, pure: what it observed and its clock readings in, an answer
and a reason out (the daemon acts on them)."""
