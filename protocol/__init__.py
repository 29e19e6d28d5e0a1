"""Messages and socket plumbing shared by the frontend, scheduler and worker processes.

Nothing in this package imports torch: every process, the API front end included, can load it.
"""
