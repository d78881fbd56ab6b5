"""Dashboard panels: each takes plain snapshot views through a method call, never I/O."""

from tui.widgets.batch import BatchPanel
from tui.widgets.events import EventLog
from tui.widgets.flows import FlowsPanel
from tui.widgets.histogram import AcceptHistogram
from tui.widgets.hosts import HOST_SORTS, HostsPanel, sort_hosts
from tui.widgets.links import LinksPanel
from tui.widgets.sessions import SessionsPanel
from tui.widgets.status import StatusBar

__all__ = [
    "AcceptHistogram", "BatchPanel", "EventLog", "FlowsPanel", "HOST_SORTS", "HostsPanel", "LinksPanel",
    "SessionsPanel", "StatusBar", "sort_hosts",
]
