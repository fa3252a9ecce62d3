"""A number-guessing game written as OpenEnv documents environments (``openenv init``'s layout:
``models.py`` with the Action/Observation types, ``server/guess_environment.py`` with the
``Environment``, ``server/app.py`` with ``create_app``).  It imports ``openenv``, so it runs only
in the OpenEnv venv (``bash install.sh --openenv``), never in arl's; arl reaches it over OpenEnv's
WebSocket protocol (``env.name: openenv``, arl/env/openenv_env.py)."""
