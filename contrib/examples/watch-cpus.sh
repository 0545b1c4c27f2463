#!/bin/sh
# Print the container's CPU list now and after every change, for workloads not in Python.
# Watches the directory, not the file: cpushim replaces `cpus` by renaming a new file over it,
# so each change is a moved_to event naming `cpus`. The first cat runs once inotifywait says
# its watch is in place (on stderr, hence 2>&1), so no change slips between the two.
# Needs inotify-tools. Usage: watch-cpus.sh [DIR]   (DIR defaults to /run/cpushim)
d=${1:-/run/cpushim}; inotifywait -m -e moved_to --format %f "$d" 2>&1 | while read -r f; do case $f in cpus | "Watches established.") cat "$d/cpus" ;; esac; done
