"""The HTTP edge: connections, the guard at the headers, routes, the console, ``create_app``.
The top of the server; nothing below imports it."""
