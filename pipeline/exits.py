"""Process exit codes every part of a run agrees on (the supervisor decides restarts by them)."""

EXIT_OK = 0
EXIT_USAGE = 2  # a bad config, argument or file: the message names it; restarting cannot help
# the process stopped the run on purpose, e.g. the reward never fires (sysexits' EX_CONFIG: what it found is most
# likely misconfigured); the supervisor never restarts it
EXIT_FATAL = 78
