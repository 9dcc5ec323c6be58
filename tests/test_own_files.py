"""The tests that count where a call came from tell flashdraft's files by the package's location: in a checkout
named `flashdraft` under a path with a space, the package's files are its own and the virtualenv's are not."""

import flashdraft.train.step
from tests.own_files import inside


def test_a_file_is_the_packages_by_where_the_package_lives(tmp_path):
    checkout = tmp_path / "my clone" / "flashdraft"  # git clone's default name, under a path with a space
    package = checkout / "flashdraft"
    ours = package / "train" / "step.py"
    torch_file = checkout / ".venv" / "lib" / "python3.11" / "site-packages" / "torch" / "optim" / "adamw.py"
    test_file = checkout / "tests" / "flashdraft" / "x.py"
    for path in (ours, torch_file, test_file):
        path.parent.mkdir(parents=True)
        path.write_text("")
    assert inside(str(ours), str(package)) == "train/step.py"
    assert inside(str(torch_file), str(package)) is None
    assert inside(str(test_file), str(package)) is None
    assert inside(str(checkout / "flashdraft-extra" / "a.py"), str(package)) is None  # a sibling sharing the prefix
    assert inside(flashdraft.train.step.__file__) == "train/step.py"  # this checkout, wherever it is
