"""Screens pushed over the dashboard."""

from tui.screens.session_detail import SessionDetailScreen

__all__ = ["SessionDetailScreen"]
