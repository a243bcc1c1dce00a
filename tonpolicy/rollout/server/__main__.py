from tonpolicy.process_exit import exit_now
from tonpolicy.rollout.server.app import main

# The server has stopped serving and closed its files when main returns.
exit_now(main())
