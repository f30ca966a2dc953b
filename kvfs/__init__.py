"""kvfs component."""
