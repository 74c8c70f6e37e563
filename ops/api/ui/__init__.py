"""The web UI at ``/ui``: static pages (``static/``, plain HTML, CSS and JavaScript
modules shipped as package data, no build step) and the JSON they read (``routes``)."""
