from tonpolicy.log_setup import configure_process
from tonpolicy.process_exit import exit_now
from tonpolicy.rollout.server.app import main

configure_process()  # the server's lines at INFO (or $TONPOLICY_LOG_LEVEL), on stderr

# The server has stopped serving and closed its files when main returns.
exit_now(main())
