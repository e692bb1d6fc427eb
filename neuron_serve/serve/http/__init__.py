"""HTTP shared by every app: JSON errors, body reading, auth, client disconnects; the server app at ``/``."""
