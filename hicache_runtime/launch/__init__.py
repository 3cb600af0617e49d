"""Starting and finishing runs: the launcher and its rendezvous, the entry point of one rank
process, a whole run with its reference and verdict, the stall watchdog, thread pinning."""
