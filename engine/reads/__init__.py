"""Read models handed to users: an instance's status and history, and paged listings."""
