"""``python -m trl_mdi.synthetic``: write a synthetic A-OKVQA (see `trl_mdi.synthetic.main`)."""

from . import main

if __name__ == "__main__":
    main()
