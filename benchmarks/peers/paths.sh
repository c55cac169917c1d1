# Sourced by the setup scripts: the shell twin of paths.py (keep both in step).
# Everything lands in the user's own cache, so a non-root user needs no special permissions.
CACHE="${PAGEDSERVE_PEERS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pagedserve-peers}"
TOOLS_CACHE="${PAGEDSERVE_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pagedserve-tools}"
TOOLS="$TOOLS_CACHE/tools-venv"
